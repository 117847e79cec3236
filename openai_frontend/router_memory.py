"""What the router remembers each tritonserver was sent: prompt chunks, as hashes, each with the
servers it went to. The frontend's `--workers` processes share one table, in a file each maps, so
that a chat's next turn finds the server that holds its history whichever process takes it.

The file also holds each process's requests in flight per server, a row each, so that every
process balances by the servers' whole load, not by its own share of it. A process claims its
row when it maps the file (under a file lock) and writes only that row; a row whose process is
gone is cleared.

The table is set-associative: a chunk's hash picks a bucket of WAYS entries, and a chunk not in
it takes the bucket's least recently used entry. An entry is three 8-byte words: the hash, a bit
per server it was sent to, and when it was last used (CLOCK_MONOTONIC, the same in every
process). There are no locks. A race between two processes can lose a bit, or keep one chunk
twice; it costs at most one misrouted request. It never gives a wrong answer: the engine's own
prefix cache decides what is reused.

Chunk hashes are made with numpy and the same in every process (Python's `hash` of a str is
salted per process). A chunk's hash covers the whole prompt up to its end, so equal hashes at
chunk i mean an equal prompt up to there. A server's match is the number of leading chunks sent
to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
from typing import Iterator, NamedTuple, Optional, Sequence

import numpy as np

from openai_frontend.processes import process_alive

log = logging.getLogger(__name__)

CHUNK_BYTES = 64  # of the prompt's UTF-8: the engine hashes its KV blocks as 16-token chunks
WAYS = 8
MAX_SERVERS = 64  # one bit each in an entry's word
MAX_PROCESSES = 64  # rows of loads: frontend processes sharing one file
_MAGIC = 0x324D5452  # "RTM2"
_HEADER = 8  # words: magic, servers, entries
_COUNTS = MAX_SERVERS  # words: chunks remembered per server, for least_seen placement
_PIDS = MAX_PROCESSES  # words: the process of each row of loads (0: free)
_LOADS = MAX_PROCESSES * MAX_SERVERS  # words: each row's requests in flight per server
_SWEEP_S = 5.0  # how often a process looks for rows of processes that are gone

_U64 = np.uint64
_SPLITMIX = (_U64(0x9E3779B97F4A7C15), _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB))
# Per word of a chunk, and per chunk position: the same value in two places hashes apart.
_WORD_KEYS = np.array([0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89,
                       0x452821E638D01377, 0xBE5466CF34E90C6C, 0xC0AC29B7C97C50DD, 0x3F84D5B5B5470917], dtype=_U64)
_POSITION_KEY = _U64(0x9216D5D98979FB1B)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise: every input bit moves about half the output bits."""
    x = x + _SPLITMIX[0]
    x = (x ^ (x >> _U64(30))) * _SPLITMIX[1]
    x = (x ^ (x >> _U64(27))) * _SPLITMIX[2]
    return x ^ (x >> _U64(31))


def chunk_hashes(key: str) -> np.ndarray:
    """Hashes of the key's whole CHUNK_BYTES chunks (of its UTF-8), each covering the key up to
    the chunk's end: equal arrays up to i mean equal keys up to chunk i's end."""
    data = key.encode("utf-8", "surrogatepass")
    n = len(data) // CHUNK_BYTES
    if n == 0:
        return np.zeros(0, dtype=_U64)
    words = np.frombuffer(data, dtype="<u8", count=n * CHUNK_BYTES // 8).reshape(n, CHUNK_BYTES // 8)
    # Each word through a bijection of its own (key, odd multiplier, xorshift), the chunk their XOR.
    words = (words ^ _WORD_KEYS) * _SPLITMIX[1]
    chunks = np.bitwise_xor.reduce(words ^ (words >> _U64(31)), axis=1)
    positioned = _mix(chunks ^ (np.arange(n, dtype=_U64) * _POSITION_KEY))
    # A prefix's hash is the wrapping sum of its chunks' (position-keyed, well mixed, so its low
    # bits, which pick the bucket, are even): order and content count.
    return np.cumsum(positioned, dtype=_U64)


def _words(servers: int, capacity: int) -> tuple[int, int]:
    """The table's entries (at least `capacity`, a power of two of whole buckets) and its size
    in 8-byte words."""
    buckets = 1 << (max(1, -(-capacity // WAYS)) - 1).bit_length()
    entries = buckets * WAYS
    return entries, _HEADER + _COUNTS + _PIDS + _LOADS + 3 * entries


class Seen(NamedTuple):
    """A prompt's chunks as the table has them (RouterMemory.lookup)."""

    hashes: np.ndarray
    slots: np.ndarray  # each hash's bucket, as its WAYS entry indexes (chunks, WAYS)
    bits: np.ndarray  # its servers' bits, 0 when not in the table
    where: np.ndarray  # its entry, where found
    found: np.ndarray


class RouterMemory:
    """The table, private to this process (`path` None) or in the file at `path`, which
    `create_file` made for the processes that share it."""

    def __init__(self, servers: int, capacity: int, path: Optional[str] = None) -> None:
        if not 1 <= servers <= MAX_SERVERS:
            raise ValueError(f"the router takes 1 to {MAX_SERVERS} tritonservers, not {servers}")
        self.servers = servers
        self.entries, size = _words(servers, capacity)
        self.path = path
        self._row: Optional[int] = None  # this process's row of loads, in a shared file
        self._swept = 0.0
        if path is None:
            words = np.zeros(size, dtype=_U64)
            words[:3] = (_MAGIC, servers, self.entries)
        else:
            self._file = open(path, "r+b")
            self._map = mmap.mmap(self._file.fileno(), size * 8)
            words = np.frombuffer(self._map, dtype=_U64)
            if tuple(int(w) for w in words[:3]) != (_MAGIC, servers, self.entries):
                raise ValueError(f"{path} is not a router memory for {servers} servers and {self.entries} entries")
        at = _HEADER
        self._counts = words[at:at + _COUNTS].view(np.int64)
        at += _COUNTS
        self._pids = words[at:at + _PIDS]
        at += _PIDS
        self._loads = words[at:at + _LOADS].view(np.int64).reshape(MAX_PROCESSES, MAX_SERVERS)
        body = words[at + _LOADS:]
        self._tags, self._bits, self._stamps = body[:self.entries], body[self.entries:2 * self.entries], body[2 * self.entries:]
        self._ways = np.arange(WAYS)
        self._shifts = np.arange(servers, dtype=_U64)
        if path is not None:
            self._claim_row()

    @staticmethod
    def create_file(path: str, servers: int, capacity: int) -> None:
        """Make the shared table's file (zeros: nothing remembered) before the processes start."""
        entries, size = _words(servers, capacity)
        with open(path, "wb") as f:
            f.truncate(size * 8)
            f.write(np.array([_MAGIC, servers, entries], dtype=_U64).tobytes())

    @classmethod
    def shared_or_private(cls, servers: int, capacity: int, path: Optional[str]) -> "RouterMemory":
        """The shared table at `path`, or this process's own when there is none to map."""
        if path:
            try:
                return cls(servers, capacity, path)
            except (OSError, ValueError) as exc:
                log.warning("router memory %s not usable (%s): this process routes by its own", path, exc)
        return cls(servers, capacity)

    def set_load(self, server: int, in_flight: int) -> None:
        """This process now has `in_flight` requests on `server` (shared: others read it)."""
        if self._row is not None:
            self._loads[self._row, server] = in_flight

    def loads(self, own: Sequence[int]) -> list[int]:
        """Requests in flight per server: every sharing process's, or just `own` (this
        process's) when the table is private."""
        if self._row is None:
            return list(own)
        now = time.monotonic()
        if now - self._swept >= _SWEEP_S:
            self._swept = now
            with self._locked():
                self._clear_gone(self._live_rows())
        return [int(n) for n in self._loads[:, :self.servers].sum(axis=0)]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Rows are claimed and cleared under the file's lock (loads are written without it)."""
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def _claim_row(self) -> None:
        """Take a free row, or one whose process is gone (cleared first)."""
        with self._locked():
            live = self._live_rows()
            self._clear_gone(live)
            row = next((i for i in range(MAX_PROCESSES) if not live[i]), None)
            if row is None:
                log.warning("router memory %s: %d processes share it already; this one's load is not shared",
                            self.path, MAX_PROCESSES)
                return
            self._loads[row] = 0
            self._pids[row] = os.getpid()
            self._row = row

    def _live_rows(self) -> list[bool]:
        return [bool(pid) and process_alive(int(pid)) for pid in self._pids]

    def _clear_gone(self, live: list[bool]) -> None:
        """A process killed with requests in flight left them in its row: they count no more."""
        for row, pid in enumerate(self._pids):
            if pid and not live[row]:
                self._loads[row] = 0
                self._pids[row] = 0

    def count(self, server: int) -> int:
        """About how many chunks the server holds here (exact within one process)."""
        return max(0, int(self._counts[server]))

    def lookup(self, hashes: np.ndarray) -> Seen:
        """Where a prompt's chunk hashes are in the table, for `matched` and then `remember`."""
        slots = (hashes & _U64(self.entries // WAYS - 1)).astype(np.int64)[:, None] * WAYS + self._ways
        hit = self._tags[slots] == hashes[:, None]
        found = hit.any(axis=1)
        where = slots[np.arange(len(hashes)), hit.argmax(axis=1)]
        return Seen(hashes, slots, np.where(found, self._bits[where], _U64(0)), where, found)

    def matched(self, seen: Seen, servers: Sequence[int]) -> list[int]:
        """Per server, how many of the prompt's leading chunks were sent to it."""
        if not seen.hashes.size:
            return [0] * len(servers)
        has = ((seen.bits[:, None] >> self._shifts[list(servers)]) & _U64(1)).astype(bool)  # (chunks, servers)
        return [int(n) for n in np.where(has.all(axis=0), len(seen.hashes), has.argmin(axis=0))]

    def remember(self, server: int, seen: Seen) -> None:
        """The prompt looked up as `seen` was sent to `server`."""
        if not seen.hashes.size:
            return
        bit, now = _U64(1) << _U64(server), _U64(time.monotonic_ns())
        found = seen.found
        known = seen.where[found]
        self._bits[known] = seen.bits[found] | bit
        self._stamps[known] = now
        added = int(np.count_nonzero((seen.bits[found] & bit) == 0))
        pending, slots = seen.hashes[~found], seen.slots[~found]
        while pending.size:  # new chunks: one per bucket at a time, each into its bucket's LRU way
            _, first = np.unique(slots[:, 0], return_index=True)
            taken = slots[first]
            victims = taken[np.arange(len(first)), self._stamps[taken].argmin(axis=1)]
            self._uncount(self._bits[victims])
            self._bits[victims] = bit
            self._stamps[victims] = now
            self._tags[victims] = pending[first]
            added += len(first)
            if len(first) == len(pending):
                break
            left = np.ones(len(pending), dtype=bool)
            left[first] = False
            pending, slots = pending[left], slots[left]
        self._counts[server] += added

    def forget(self, server: int) -> None:
        """Nothing was sent to `server` (its cache is gone, or going)."""
        self._bits &= ~(_U64(1) << _U64(server))
        self._counts[server] = 0

    def _uncount(self, bits: np.ndarray) -> None:
        """Entries with these bits are taken over: their servers hold that many fewer chunks."""
        if bits.any():
            self._counts[:self.servers] -= ((bits[:, None] >> self._shifts) & _U64(1)).sum(axis=0).astype(np.int64)


def shared_path(directory: str) -> str:
    """Where the processes sharing `directory` keep the table."""
    return os.path.join(directory, "router_memory")

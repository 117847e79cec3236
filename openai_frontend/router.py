"""Which tritonserver takes a request, when the frontend serves several (data parallelism).

The `llm` model holds one engine, and one KV pool, per tritonserver (it refuses more instances:
an abort must reach the engine that runs the request). A host with several GPUs therefore runs
one tritonserver per GPU, and the frontend spreads requests over them: `--triton-url` given more
than once.

The default policy is SGLang router's `cache_aware`: a request goes to the server that has
already seen the longest start of its prompt, so that the engine's prefix cache there serves it
(a system prompt, a chat's earlier turns, a few-shot preamble), unless the servers' loads have
drifted apart, when the least loaded one takes it. Round robin would send a chat's next turn to
another server half the time (two servers), which then prefills the whole history again.

A prompt no server has seen enough of is placed (`placement`): `least_seen`, SGLang router's
choice, sends it to the server that has seen the least; `hash` sends it where a hash of its
opening (a chat's messages up to its first user message; a prompt's first OPENING_CHARS) ranks
the servers first, unless that one carries more than PLACEMENT_LOAD_FACTOR times the average load
(consistent hashing with bounded loads). Every process computes that rank alike, from the chat
alone, where `least_seen` reads counts that several `--workers` processes placing at the same
moment read alike (they would pile onto one server), and that a process without the shared
memory (one that could not map it) has only of its own. The frontend uses `hash` when it runs
several processes.

What a server "has seen" is remembered as the hashes of each prompt's 64-byte chunks (the
engine's block hashes, on text), in a table the frontend's processes share (router_memory.py):
the match is the number of leading chunks sent to the server, out of at most `max_chunks` per
server. It approximates the server's real cache: the router sees prompts, not KV blocks, and the
engine may have evicted what the router remembers. A server seen going down is forgotten
(`forget`): it most likely comes back restarted, empty.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from openai_frontend.engine_types import EngineRequest
from openai_frontend.router_memory import RouterMemory, chunk_hashes

POLICIES = ("cache_aware", "load_aware", "round_robin", "power_of_two", "random")
CACHE_POLICIES = ("cache_aware", "load_aware")  # those that read what each server was sent
PLACEMENTS = ("least_seen", "hash")
OPENING_CHARS = 1024
PLACEMENT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class RouterConfig:
    """SGLang router's settings, by its names."""

    policy: str = "cache_aware"
    # A server takes a request for its cache only when it has seen more than this share of it.
    cache_threshold: float = 0.5
    # Loads count as drifted apart (least loaded takes the request) when the busiest server has
    # more than `balance_abs_threshold` requests above the idlest and more than
    # `balance_rel_threshold` times its count.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_chunks: int = 1 << 16  # remembered prompt chunks per server (64 bytes each)
    placement: str = "least_seen"  # cache_aware, a prompt no server has seen enough of: see the module's doc
    # load_aware: how much a server's load counts against what it has cached (see _load_aware).
    load_beta: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: abs >= 0, rel >= 1")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")
        if self.load_beta < 0:
            raise ValueError("load_beta must be at least 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r} is not one of {', '.join(PLACEMENTS)}")


def routing_key(request: EngineRequest) -> str:
    """The text whose start decides where the request's KV is cached: what reaches the engine's
    prompt in the same order (tools and template options are rendered before the messages), and
    the LoRA adapter (the engine caches each adapter's blocks apart). Empty for embeddings."""
    adapter = request.sampling_params.get("lora_path") or ""
    if request.messages is not None:
        head = json.dumps([request.tools, request.chat_template_kwargs, request.chat_template, request.documents],
                          sort_keys=True, default=str)
        # A chat's next turn appends to the list: its JSON starts as the last turn's did.
        body = json.dumps(request.messages, sort_keys=True, separators=(",", ":"), default=str)
        return f"{adapter}\x00{head}\x00{body}"
    if request.text_input is not None:
        return f"{adapter}\x00{request.text_input}"
    if request.input_ids is not None:
        return f"{adapter}\x00" + ",".join(map(str, request.input_ids))
    return ""


def conversation_opening(request: EngineRequest, key: str) -> str:
    """What a new prompt is placed by (see the module's doc): for a chat, everything up to its
    first user message, which its later turns repeat; otherwise the key's first OPENING_CHARS."""
    if request.messages is not None:
        first_user = next((i for i, m in enumerate(request.messages)
                           if isinstance(m, dict) and m.get("role") == "user"), len(request.messages) - 1)
        body = json.dumps(request.messages[:first_user + 1], sort_keys=True, separators=(",", ":"), default=str)
        return key[:key.rindex("\x00") + 1] + body
    return key[:OPENING_CHARS]


class Router:
    """Picks a server index per request. `memory_path`: the table of what each server was sent
    and of each process's load, shared with the frontend's other processes (router_memory.py;
    None: this process's own)."""

    def __init__(self, servers: int, config: RouterConfig = RouterConfig(), seed: Optional[int] = None,
                 names: Optional[Sequence[str]] = None, memory_path: Optional[str] = None) -> None:
        self.config = config
        # What placement hashes with the opening: the servers' URLs, so that frontends listing them
        # in another order still agree.
        self._names = [n.encode() for n in (names or [str(i) for i in range(servers)])]
        # One server: nothing to choose between (the client does not route), so no room is kept.
        capacity = config.max_chunks * servers if servers > 1 else 1
        self.memory = RouterMemory.shared_or_private(servers, capacity, memory_path)
        # Per server, this process's: prompt chunks routed there, and of those, ones it had been
        # sent before (what its prefix cache should hold): the frontend's /metrics.
        self.prompt_chunks = [0] * servers
        self.prompt_chunks_matched = [0] * servers
        self._next = 0
        self._random = random.Random(seed)

    @property
    def places_by_opening(self) -> bool:
        """Whether `choose` reads a request's conversation_opening (else it need not be made)."""
        return self.config.policy in CACHE_POLICIES and self.config.placement == "hash"

    def note_load(self, server: int, in_flight: int) -> None:
        """This process now has `in_flight` requests on `server`."""
        self.memory.set_load(server, in_flight)

    def choose(self, key: str, loads: Sequence[int], eligible: Sequence[int], opening: Optional[str] = None) -> int:
        """A server among `eligible` (indexes, not empty) for a request whose routing_key is `key`
        and conversation_opening `opening` (default: the key's start). `loads`: this process's
        requests in flight per server; with a shared memory, every process's count instead."""
        loads = self.memory.loads(loads)
        if self.config.policy in CACHE_POLICIES:
            # Also with one server eligible (the others down): what it is sent is remembered.
            opening = key[:OPENING_CHARS] if opening is None else opening
            seen = self.memory.lookup(chunk_hashes(key))
            matched = dict(zip(eligible, self.memory.matched(seen, eligible)))
            pick = self._cache_aware if self.config.policy == "cache_aware" else self._load_aware
            choice = pick(len(seen.hashes), matched, opening, loads, eligible)
            self.memory.remember(choice, seen)
            self.prompt_chunks[choice] += len(seen.hashes)
            self.prompt_chunks_matched[choice] += matched[choice]
            return choice
        if len(eligible) == 1:
            choice = eligible[0]
        elif self.config.policy == "round_robin":
            choice = min(eligible, key=lambda i: (i - self._next) % len(loads))
        elif self.config.policy == "power_of_two":
            a, b = self._random.sample(list(eligible), 2)
            choice = a if loads[a] <= loads[b] else b
        else:
            choice = self._random.choice(list(eligible))
        self._next = choice + 1
        return choice

    def forget(self, server: int) -> None:
        """Drop what `server` was remembered to have seen (its cache is gone, or going)."""
        self.memory.forget(server)

    def _cache_aware(self, chunks: int, matched: dict[int, int], opening: str, loads: Sequence[int],
                     eligible: Sequence[int]) -> int:
        """`matched`: per eligible server, how many of the prompt's `chunks` it was sent."""
        busiest, idlest = max(loads[i] for i in eligible), min(loads[i] for i in eligible)
        drifted = (busiest - idlest > self.config.balance_abs_threshold
                   and busiest > idlest * self.config.balance_rel_threshold)
        if drifted or not chunks:
            return min(eligible, key=lambda i: (loads[i], self.memory.count(i)))
        best = max(eligible, key=lambda i: (matched[i], -loads[i]))
        if matched[best] / chunks > self.config.cache_threshold:
            return best
        return self._place(opening, loads, eligible)

    def _load_aware(self, chunks: int, matched: dict[int, int], opening: str, loads: Sequence[int],
                    eligible: Sequence[int]) -> int:
        """vLLM production-stack's `loadaware`: the highest score, the share of the prompt a server
        has seen less `load_beta` times its load's distance from the mean, in units of the mean
        (one in flight at least). cache_aware sends every request that starts with a long shared
        system prompt to the one server that saw it first until loads differ by
        balance_abs_threshold; here a server twice as busy as the mean gives up a whole prompt's
        worth of cache, so the others take requests, pay that prefix once, and share the load.
        Ties (nothing seen, equal loads) are placed as a new prompt."""
        mean = sum(loads[i] for i in eligible) / len(eligible)
        scores = [matched[i] / max(1, chunks) - self.config.load_beta * (loads[i] - mean) / max(1.0, mean)
                  for i in eligible]
        top = max(scores)
        tied = [i for i, score in zip(eligible, scores) if score >= top - 1e-9]
        return tied[0] if len(tied) == 1 else self._place(opening, loads, tied)

    def _place(self, opening: str, loads: Sequence[int], eligible: Sequence[int]) -> int:
        """A new prompt's server, by `placement`. least_seen: the one with the least remembered
        (most room for a new prefix), then the least loaded. hash: the first its opening ranks (a
        keyed hash, the same in every process, not Python's salted one) whose load stays within
        PLACEMENT_LOAD_FACTOR times the average once it takes it, else the least loaded."""
        if self.config.placement == "least_seen":
            return min(eligible, key=lambda i: (self.memory.count(i), loads[i]))
        least_loaded = min(eligible, key=lambda i: (loads[i], self.memory.count(i)))
        digest = hashlib.blake2b(opening.encode(), digest_size=16).digest()
        ranked = sorted(eligible, key=lambda i: hashlib.blake2b(self._names[i], key=digest, digest_size=8).digest(),
                        reverse=True)
        bound = math.ceil(PLACEMENT_LOAD_FACTOR * (sum(loads[i] for i in eligible) + 1) / len(eligible))
        return next((i for i in ranked if loads[i] + 1 <= bound), least_loaded)

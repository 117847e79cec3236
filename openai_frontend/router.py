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

What a server "has seen" is remembered here as the chained hashes of each prompt's 64-character
chunks (the engine's block hashes, on text): the match is the number of leading chunks the server
has, bounded per server by an LRU of `max_chunks`. It approximates the server's real cache: the
router sees prompts, not KV blocks, and the engine may have evicted what the router remembers.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from openai_frontend.engine_types import EngineRequest

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
CHUNK_CHARS = 64


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
    max_chunks: int = 1 << 16  # remembered prompt chunks per server (64 characters each)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: abs >= 0, rel >= 1")
        if self.max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")


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


def chunk_hashes(key: str) -> list[int]:
    """Chained hashes of the key's whole CHUNK_CHARS chunks: equal lists up to i mean equal
    text up to chunk i's end."""
    hashes, prev = [], 0
    for start in range(0, len(key) - CHUNK_CHARS + 1, CHUNK_CHARS):
        prev = hash((prev, key[start:start + CHUNK_CHARS]))
        hashes.append(prev)
    return hashes


class Router:
    """Picks a server index per request; `loads` are the requests each server has in flight
    from this process (each frontend worker routes on its own)."""

    def __init__(self, servers: int, config: RouterConfig = RouterConfig(), seed: Optional[int] = None) -> None:
        self.config = config
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(servers)]
        self._next = 0
        self._random = random.Random(seed)

    def choose(self, key: str, loads: Sequence[int], eligible: Sequence[int]) -> int:
        """A server among `eligible` (indexes, not empty) for a request whose routing_key is `key`."""
        if len(eligible) == 1:
            choice = eligible[0]
        elif self.config.policy == "round_robin":
            choice = min(eligible, key=lambda i: (i - self._next) % len(loads))
        elif self.config.policy == "random":
            choice = self._random.choice(list(eligible))
        elif self.config.policy == "power_of_two":
            a, b = self._random.sample(list(eligible), 2)
            choice = a if loads[a] <= loads[b] else b
        else:
            return self._cache_aware(chunk_hashes(key), loads, eligible)
        self._next = choice + 1
        return choice

    def _cache_aware(self, hashes: list[int], loads: Sequence[int], eligible: Sequence[int]) -> int:
        busiest, idlest = max(loads[i] for i in eligible), min(loads[i] for i in eligible)
        drifted = (busiest - idlest > self.config.balance_abs_threshold
                   and busiest > idlest * self.config.balance_rel_threshold)
        least_loaded = min(eligible, key=lambda i: (loads[i], len(self._seen[i])))
        if drifted or not hashes:
            choice = least_loaded
        else:
            matched = {i: self._matched(i, hashes) for i in eligible}
            best = max(eligible, key=lambda i: (matched[i], -loads[i]))
            # No server has seen enough of it: the one with the least remembered (most room
            # for a new prefix), the least loaded among equals: SGLang's choice.
            choice = best if matched[best] / len(hashes) > self.config.cache_threshold else min(
                eligible, key=lambda i: (len(self._seen[i]), loads[i]))
        self._remember(choice, hashes)
        return choice

    def _matched(self, server: int, hashes: list[int]) -> int:
        seen = self._seen[server]
        for n, h in enumerate(hashes):
            if h not in seen:
                return n
        return len(hashes)

    def _remember(self, server: int, hashes: list[int]) -> None:
        seen = self._seen[server]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.config.max_chunks:
            seen.popitem(last=False)

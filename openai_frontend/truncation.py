"""`truncation: "auto"` (the Responses API): a prompt past the model's context loses its oldest
messages, whole turns at a time, until it fits with room for the answer.

The instructions (the leading system and developer messages) stay. The prompt then starts at a
user message, never at an assistant's or a tool result (a tool result without its call, or an
answer without its question, is a history no template expects). Each candidate is counted as
generation renders it (the chat route's `prompt_tokens`: template, tools and all), and the
candidates are searched by halves, so a history of n turns costs about log2(n) counts.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

Messages = list[dict[str, Any]]


def _kept_prefix(messages: Messages) -> int:
    k = 0
    while k < len(messages) and messages[k].get("role") in ("system", "developer"):
        k += 1
    return k


async def truncated(messages: Messages, tokens: Callable[[Messages], Awaitable[int]], limit: int
                    ) -> Optional[Messages]:
    """`messages` with the fewest oldest turns dropped whose prompt is at most `limit` tokens;
    None when even the last turn alone is over it (or there is no turn to drop)."""
    keep = _kept_prefix(messages)
    # Where the kept part may resume: each user message after the first one kept.
    starts = [j for j in range(keep + 1, len(messages)) if messages[j].get("role") == "user"]
    lo, hi = 0, len(starts) - 1
    best: Optional[Messages] = None
    while lo <= hi:  # the fewest dropped that fits: the counts fall as more is dropped
        mid = (lo + hi) // 2
        candidate = messages[:keep] + messages[starts[mid]:]
        if await tokens(candidate) <= limit:
            best, hi = candidate, mid - 1
        else:
            lo = mid + 1
    return best

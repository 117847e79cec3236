"""`best_of`: generate `best_of` samples per prompt, return the `n` best.

"Best" is OpenAI's definition: the highest log probability per generated token (vLLM's v0
engine ranked by the sum, which favours short samples). Ties keep sample order. The samples
run as one engine request with n = best_of, so they share the prompt's KV blocks; the engine
reports each sampled token's logprob (`return_logprob`) whether or not the client asked for
logprobs, and the handlers show them only when it did.

Nothing can be sent before every sample has finished, so best_of > n is refused with
`stream: true` (as OpenAI and vLLM do). `usage.completion_tokens` counts the returned
samples' tokens, as vLLM's did.
"""

from __future__ import annotations

import math
from typing import AsyncIterator, Optional, Sequence

from openai_frontend.engine_types import EngineChunk, EngineClient, EngineRequest
from openai_frontend.errors import bad_request
from openai_frontend.streams import Item, iterate_choices


def samples_per_prompt(best_of: Optional[int], n: int, stream: bool, max_n: int) -> int:
    """How many samples to generate for each prompt: `best_of`, checked, or `n`."""
    if best_of is None or best_of == n:
        return n
    if best_of < n:
        raise bad_request(f"best_of must be >= n, got best_of={best_of} and n={n}", param="best_of")
    if best_of > max_n:
        raise bad_request(f"best_of must be at most {max_n}, got {best_of}", param="best_of")
    if stream:
        raise bad_request("best_of > n cannot be streamed: every sample must finish before the best are chosen",
                          param="best_of")
    return best_of


def with_sampled_logprobs(sampling_params: dict) -> dict:
    """The request's sampling parameters, asking the engine for the sampled tokens' logprobs."""
    return {**sampling_params, "return_logprob": True}


async def iterate_best(client: EngineClient, requests: Sequence[EngineRequest], n: int) -> AsyncIterator[Item]:
    """Like `iterate_choices`, for requests carrying n = best_of: once every sample is done,
    the chunks of each prompt's `n` best samples, as choices prompt * n + rank."""
    best_of = requests[0].n
    chunks: dict[int, list[EngineChunk]] = {}
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    it = iterate_choices(client, requests)
    try:
        async for index, chunk in it:
            chunks.setdefault(index, []).append(chunk)
            for lp in chunk.logprobs(0) or ():
                if lp.logprob is not None:
                    total[index] = total.get(index, 0.0) + lp.logprob
                    count[index] = count.get(index, 0) + 1
    finally:
        await it.aclose()
    for p in range(len(requests)):
        samples = range(p * best_of, (p + 1) * best_of)
        # an empty sample (max_tokens 0) has no mean: it ranks after every sample with tokens
        ranked = sorted(samples, key=lambda s: -total[s] / count[s] if count.get(s) else math.inf)
        for rank, s in enumerate(ranked[:n]):
            for chunk in chunks.get(s, ()):
                yield p * n + rank, chunk

"""Where a non-streaming response's choices come from: the engine's samples as they arrive, the
`n` best of `best_of` samples (`best_of.py`), or the best beams (`beam_search.py`)."""

from __future__ import annotations

from typing import AsyncIterator, Optional, Sequence

from openai_frontend.beam_search import BeamSpec, beam_search_choices
from openai_frontend.best_of import iterate_best
from openai_frontend.engine_types import EngineClient, EngineRequest
from openai_frontend.streams import Item, iterate_choices


def returned_choices(
    client: EngineClient, requests: Sequence[EngineRequest], n: int, beams: Optional[BeamSpec] = None,
) -> AsyncIterator[Item]:
    """(choice index, chunk) pairs for `n` choices per request."""
    if beams is not None:
        return beam_search_choices(client, requests, beams)
    if requests[0].n > n:
        return iterate_best(client, requests, n)
    return iterate_choices(client, requests)

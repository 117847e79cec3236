"""The request being served, for log lines written far from its handler (a stream's error, an
unhandled exception): its id as the client sees it in X-Request-Id."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Optional

# The request's state dict itself, not its id: a route may still name the request from its body
# (`request_id`, `rid`) after the middleware bound it.
_STATE: ContextVar[Optional[dict[str, Any]]] = ContextVar("request_state", default=None)


def bind(state: dict[str, Any]) -> None:
    _STATE.set(state)


def request_id() -> str:
    state = _STATE.get()
    return str(state.get("request_id", "-")) if state is not None else "-"

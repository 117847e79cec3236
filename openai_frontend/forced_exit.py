"""uvicorn's forced exit (a second Ctrl-C), made to let the streams it leaves send their aborts.

On a forced exit uvicorn returns without waiting for the requests in flight or running the app's
lifespan shutdown, then re-raises the signals it caught, the last first. asyncio.run would then
cancel the streams still open, and each would send the engine its abort on the way out
(triton_client.TritonLLMClient.generate): Triton does not pass a cancelled ensemble request on
to the engine's running step. But a SIGTERM among those signals (serve.sh's first stop, and what
a --workers supervisor sends its workers) ended the process by its default action first, and the
engine generated on for clients that were gone, tritonserver then waiting out its exit timeout.
After a forced exit, a caught SIGTERM is re-raised as SIGINT instead: a KeyboardInterrupt that
uvicorn expects (or nothing, where SIGINT is ignored), and asyncio.run's cleanup runs either way.
A graceful stop is left as it is: its lifespan shutdown has already waited for the aborts."""

from __future__ import annotations

import signal
from typing import Any

from uvicorn.server import Server

_MARK = "_forced_exit_sends_aborts"


def install() -> None:
    """Patch uvicorn's Server.shutdown (once per process; uvicorn is pinned in constraints.txt)."""
    original = Server.shutdown
    if getattr(original, _MARK, False):
        return

    async def shutdown(self: Server, *args: Any, **kwargs: Any) -> None:
        await original(self, *args, **kwargs)
        if self.force_exit:
            self._captured_signals = [signal.SIGINT if s == signal.SIGTERM else s for s in self._captured_signals]

    setattr(shutdown, _MARK, True)
    Server.shutdown = shutdown  # type: ignore[method-assign]

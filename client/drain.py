"""Drain the llm model before tritonserver is stopped.

    python -m client.drain [--url localhost:8001] [--grace 10] [--model llm]

A tritonserver 2.51 told to stop stops passing an ensemble's responses on at once (Triton's
ensemble scheduler; the pre- and postprocessing models unload while it still holds streams), so
an ensemble stream open at that moment stalls; the server then waits out its exit timeout and
crashed or hung on its way out. The llm model ends its own requests in time once it notices a
stop (backend/server_stop.py), but an ensemble's are beyond saving by then. Before the signal
the server still serves everything: this gives the requests in flight `--grace` seconds to
finish, then aborts the rest (`abort_all`: each ends with its final response, finish reason
"abort"), so that the signal finds nothing in flight. scripts/serve.sh and the Docker
entrypoint run it before they stop tritonserver. SIGTERM cuts the grace short (the rest are
aborted at once); Ctrl-C leaves without aborting.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

from client.triton_stream import TritonStreamClient


def _meta(answer: dict[str, Any]) -> dict[str, Any]:
    meta = answer.get("meta_info")
    return json.loads(meta) if isinstance(meta, str) else {}


def open_requests(client: TritonStreamClient, model: str = "llm") -> int:
    """Requests the model took whose final response has not gone out (engine_info's count,
    which leaves out the engine_info request itself)."""
    return int(_meta(client.generate(model, {"engine_info": True}, timeout=30))["stats"]["open_requests"])


def drain(url: str, grace_s: float, model: str = "llm", poll_s: float = 0.5,
          hurry: Optional[threading.Event] = None) -> dict[str, Any]:
    """Wait up to `grace_s` for the model's requests to end (less once `hurry` is set), then
    abort the rest. Returns {"waited_s", "left", "aborted"}."""
    hurry = hurry or threading.Event()
    client = TritonStreamClient(url, abort_model=None)
    start = time.monotonic()
    left = open_requests(client, model)
    while left and not hurry.is_set() and time.monotonic() - start < grace_s:
        hurry.wait(min(poll_s, max(0.0, grace_s - (time.monotonic() - start))))
        left = open_requests(client, model)
    aborted = 0
    if left:
        aborted = int(_meta(client.generate(model, {"abort_all": True}, timeout=30)).get("aborted", 0))
    return {"waited_s": round(time.monotonic() - start, 1), "left": left, "aborted": aborted}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.drain", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC host:port")
    p.add_argument("--grace", type=float, default=10.0, help="seconds the requests in flight get to finish")
    p.add_argument("--model", default="llm", help="the engine model")
    args = p.parse_args(argv)
    # SIGTERM (scripts/serve.sh on a second Ctrl-C): cut the grace short and abort now.
    hurry = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: hurry.set())
    try:
        result = drain(args.url, args.grace, args.model, hurry=hurry)
    except KeyboardInterrupt:  # Ctrl-C on the command itself: leave, aborting nothing
        return 130
    except Exception as exc:  # noqa: BLE001 - the caller stops the server either way
        print(f"drain: could not drain {args.model} at {args.url}: {exc}", file=sys.stderr)
        return 1
    if result["left"]:
        print(f"drain: {result['left']} request(s) still running after {result['waited_s']} s: "
              f"aborted {result['aborted']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

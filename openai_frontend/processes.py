"""Whether a process lives: the files the frontend's --workers share (metrics, the router's
memory, their directory) name their writers by pid, and what a gone writer left is dropped."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, alive
        return True
    return True

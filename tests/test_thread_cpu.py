"""bench/thread_cpu.py: the per-thread CPU it reports comes from /proc, per thread and per process."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from bench.thread_cpu import report, snapshot


def test_report_names_the_busy_thread_and_its_process():
    stop = threading.Event()
    native: list[int] = []

    def spin() -> None:
        # Hashing a large block releases the GIL: a pure-Python loop would hold it and slow the
        # snapshots (their file reads wait for it) to the point of blurring the interval.
        block = bytes(1 << 20)
        native.append(threading.get_native_id())
        while not stop.is_set():
            hashlib.sha256(block).digest()

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        while not native:
            time.sleep(0.01)
        # The thread's own CPU clock is the truth to compare with: on loaded cores (CI runs tests
        # side by side) the spinning thread may get well under one core. Each snapshot reads the
        # thread at some moment inside it: its reading lies between the clock before and after.
        clock = time.pthread_getcpuclockid(worker.ident)
        outer0 = time.clock_gettime(clock)
        before = snapshot()
        inner0 = time.clock_gettime(clock)
        # Until the thread has had 0.5 s of CPU, however loaded the cores (CI gave it 0.05 s of
        # a 0.6 s window once), so what is compared is not a few clock ticks.
        deadline = time.monotonic() + 30
        while time.clock_gettime(clock) - inner0 < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        inner1 = time.clock_gettime(clock)
        after = snapshot()
        outer1 = time.clock_gettime(clock)
    finally:
        stop.set()
        worker.join()
    pid = str(os.getpid())
    assert (pid, str(native[0])) in after  # every thread of every process, keyed by (pid, tid)
    # Over "1 second", each figure is the CPU seconds used between the snapshots.
    lines = report(before, after, 1.0, top=500).splitlines()
    spinning = next(line for line in lines if f"tid {native[0]:>7}" in line)
    assert spinning.split()[2] == pid, lines
    # /proc counts whole clock ticks (10 ms) at each end, printed to a hundredth.
    used, slack = float(spinning.split()[0]), 0.03
    assert inner1 - inner0 - slack <= used <= outer1 - outer0 + slack, (lines, inner1 - inner0, outer1 - outer0)
    assert inner1 - inner0 >= 0.5  # it did spin between the snapshots (the bound above then holds `used` to it)
    ours = next(line for line in lines if line.strip().startswith(f"process {pid:>7}"))
    assert float(ours.split()[2]) >= float(spinning.split()[0]) - 0.01  # the process sums its threads
    assert lines[0].startswith("-- ") and "cores busy" in lines[0]

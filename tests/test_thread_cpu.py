"""bench/thread_cpu.py: the per-thread CPU it reports comes from /proc, per thread and per process."""

from __future__ import annotations

import os
import threading
import time

from bench.thread_cpu import report, snapshot


def test_report_names_the_busy_thread_and_its_process():
    stop = threading.Event()
    native: list[int] = []

    def spin() -> None:
        native.append(threading.get_native_id())
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        while not native:
            time.sleep(0.01)
        before, t0 = snapshot(), time.monotonic()
        time.sleep(0.6)
        after, t1 = snapshot(), time.monotonic()
    finally:
        stop.set()
        worker.join()
    pid = str(os.getpid())
    assert (pid, str(native[0])) in after  # every thread of every process, keyed by (pid, tid)
    lines = report(before, after, t1 - t0, top=50).splitlines()
    spinning = next(line for line in lines if f"tid {native[0]:>7}" in line)
    assert spinning.split()[2] == pid and float(spinning.split()[0]) > 0.3, lines
    ours = next(line for line in lines if line.strip().startswith(f"process {pid:>7}"))
    assert float(ours.split()[2]) >= float(spinning.split()[0]) - 0.01  # the process sums its threads
    assert lines[0].startswith("-- ") and "cores busy" in lines[0]

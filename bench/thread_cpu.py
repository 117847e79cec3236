"""Where a host's CPU goes, thread by thread: samples /proc every few seconds while a benchmark
runs beside it and prints each interval's busiest threads with their process, and each process's
total. The serving benchmarks report CPU per process (tritonserver, frontend, bench); this names
the threads inside them (the step loop, OpenMP workers, gRPC pollers, the stubs' senders).

    python -m bench.thread_cpu --interval 3 --count 40 --top 20 > threads.txt &
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK")


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [p.decode(errors="replace") for p in parts if p]
    return " ".join(words)[:90] or "?"


def snapshot() -> dict[tuple[str, str], tuple[str, int]]:
    """(pid, tid) -> (thread name, utime + stime in ticks) for every thread on the host."""
    out: dict[tuple[str, str], tuple[str, int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            # comm may hold spaces and parentheses: it ends at the last ')'.
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[(pid, tid)] = (name, int(fields[11]) + int(fields[12]))
    return out


def report(before: dict, after: dict, seconds: float, top: int) -> str:
    threads = []
    per_proc: dict[str, float] = defaultdict(float)
    for key, (name, ticks) in after.items():
        used = (ticks - before.get(key, (name, ticks))[1]) / _TICK / seconds
        if used <= 0:
            continue
        threads.append((used, key[0], key[1], name))
        per_proc[key[0]] += used
    threads.sort(reverse=True)
    lines = [f"-- {time.strftime('%H:%M:%S')} over {seconds:.1f}s: cores busy {sum(per_proc.values()):.2f}"]
    for pid, used in sorted(per_proc.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"  process {pid:>7} {used:5.2f}  {_cmdline(pid)}")
    for used, pid, tid, name in threads[:top]:
        lines.append(f"    {used:5.2f}  pid {pid:>7} tid {tid:>7}  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=3.0)
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    before, t0 = snapshot(), time.monotonic()
    for _ in range(args.count):
        time.sleep(args.interval)
        after, t1 = snapshot(), time.monotonic()
        print(report(before, after, t1 - t0, args.top), flush=True)
        before, t0 = after, t1


if __name__ == "__main__":
    main()
